"""Settings for the whole test run.

One torch thread: the tests' tiny models do tiny matmuls, where a second intra-op thread costs more than
it brings, and on a busy 2-core machine oversubscribed threads made tiny-model tests 10-50x slower. The
environment variable reaches the subprocesses that CLI tests start.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
