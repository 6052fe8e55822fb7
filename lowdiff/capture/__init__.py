"""lowdiff.capture: watching the training loop — what one optimizer step records, the layer-wise
gradient hooks of replica mode, changes made between steps, and loop patterns that cannot be made
exact."""
