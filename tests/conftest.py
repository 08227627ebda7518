"""Settings for every test and the processes it starts.

- The debug checks that worker state is touched only by its owning thread
  (`worker_common.check_owner`) are on.
- One kernel build and selection cache for the whole run (`engine.native`): a test that
  gives a server or a Ray head another HOME must not rebuild the C++ extension (about 90 s
  on 2 cores) under it. A test that means to build afresh sets PDSERVE_KERNELS_DIR itself.
"""

import os
from pathlib import Path

os.environ.setdefault("PDSERVE_CHECK_OWNERS", "1")
os.environ.setdefault("PDSERVE_KERNELS_DIR", str(Path.home() / ".cache" / "pdserve" / "kernels"))
