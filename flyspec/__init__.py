"""flyspec: fast and safe speculative decoding."""
