"""lowdiff.step: what one optimizer step is made of and how it is redone — the iteration boundary's
state (RNG, hyper-parameters, scheduler, user objects), the gradient compressors, and applying a
recorded step."""
