"""Load, fault and trace tooling around the product: `pdserve bench`, `pdserve chaos` (over
the in-process rig in `faults`) and `pdserve trace`. Nothing in the serving path imports it.
"""
