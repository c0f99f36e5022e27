"""The router <-> worker contract: ``pdserve.proto`` and its generated stubs."""

# Trailing-metadata key of a call a worker turned away without starting it (it drains, or
# its engine failed): the caller may try another worker knowing this one did no work and
# holds nothing. Value: the reason ("draining").
REFUSED_KEY = "pdserve-refused"
