"""Server limits that the command line needs without importing the web stack."""

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
"""Default --max-request-bytes: far above any prompt that fits a 32k-token context, small enough that a
body cannot cost the server real memory or parsing time."""

DEFAULT_REQUEST_READ_TIMEOUT_S = 60.0
"""Default --request-read-timeout: a whole body must arrive within this many seconds (8 MiB at 140 kB/s)."""

DEFAULT_GRAMMAR_TIMEOUT_S = 2.0
"""Default --grammar-timeout: a request's grammar must compile (and compute its first mask) within this;
typical JSON schemas take tens of milliseconds."""
