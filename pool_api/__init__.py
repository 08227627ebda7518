"""What the router and the worker pools both speak: the typed messages of every actor call
(`messages`), the worker API they cross (`api`), the worker configuration (`config`) and the
prefix index (`prefix_index`). `worker_common` is the code both worker packages share; the
router never imports it."""
