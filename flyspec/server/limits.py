"""Server limits that the command line needs without importing the web stack."""

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
"""Default --max-request-bytes: far above any prompt that fits a 32k-token context, small enough that a
body cannot cost the server real memory or parsing time."""
