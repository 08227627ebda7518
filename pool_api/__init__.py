"""What the router and the worker pools both speak: the typed messages of every actor call
(`messages`), the worker API they cross (`api`), the worker configuration (`config`) and the
prefix index (`prefix_index`). The code both worker packages share is `worker_common`, a
package of its own that the router never imports."""
