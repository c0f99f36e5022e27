"""The router <-> worker contract: ``pdserve.proto`` and its generated stubs."""

# Trailing-metadata key of a call a worker turned away without starting it (it drains, or
# its engine failed): the caller may try another worker knowing this one did no work and
# holds nothing. Value: the reason ("draining").
REFUSED_KEY = "pdserve-refused"

# Trailing-metadata key of an INVALID_ARGUMENT: the request field at fault, for the
# router's 400 (``param`` in the OpenAI error envelope).
PARAM_KEY = "pdserve-param"
