"""The router <-> worker contract: ``pdserve.proto`` and its generated stubs."""

# Trailing-metadata key of a call a worker turned away without starting it (it drains, or
# its engine failed): the caller may try another worker knowing this one did no work and
# holds nothing. Value: the reason ("draining"; "starting"; "engine_failed", a fault the
# caller should say as one).
REFUSED_KEY = "pdserve-refused"

# Initial-metadata key a decode worker sends once its engine holds a request that came with a
# KV handle: from then on the engine frees the prefill worker's lease itself when the
# request ends (released at once if never pulled; a transport notification after a pull),
# so a caller that leaves may cancel the call at once. Value: "1".
ADMITTED_KEY = "pdserve-admitted"

# Trailing-metadata key of an INVALID_ARGUMENT: the request field at fault, for the
# router's 400 (``param`` in the OpenAI error envelope).
PARAM_KEY = "pdserve-param"
