"""Settings for the whole test session."""

import os

# Inductor compiles its kernels in a pool of worker processes, one per core by default;
# on a 2-core machine starting that pool costs more than it saves (the torch.compile tests:
# 117 s with it, 103 s without). The compiled code is the same either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
