"""Switches on the debug checks that worker state is touched only by its owning thread
(`worker_common.check_owner`), for every test and the Ray workers it starts."""

import os

os.environ.setdefault("PDSERVE_CHECK_OWNERS", "1")
