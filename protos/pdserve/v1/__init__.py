"""pdserve's wire contracts (proto package `pdserve.v1`, generated modules beside them) and
the version of the wires pdserve owns between its own processes."""

# The version of every wire between pdserve's processes: the KV transfer (its ticket and
# frame header carry it in KVCacheLayout), the token stream's hello, and the workers'
# startup summaries the router pairs them by. Bump it on any change a peer of the previous
# version would misread. Processes of different versions never pair; the refusal names both.
#
# History:
#   1  first versioned release: the version travels in KVCacheLayout and TokenStreamHello
#      (a peer from before it sends 0).
#   2  structured outputs: the ticket carries the receiver's grammar fingerprint, which a
#      version-1 sender would ignore (it would sample token #1 unconstrained); workers also
#      report their grammar backend, and workers of different backends never pair. The
#      token stream's deltas carry prompt logprobs (a version-1 router would drop them).
#   3  n > 1: the token stream's deltas carry the choice index (a version-2 router would
#      run a request's choices together as one), and prefill results one first token per
#      choice.
WIRE_VERSION = 3
