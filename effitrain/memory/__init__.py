"""Memory, measured from real storage: the ledger (:mod:`.ledger`: optimizer state, parameters,
gradients, peaks), one step by kind (:mod:`.step`), the same step on fake tensors before a run
(:mod:`.estimate`), and saved optimizer states read safely (:mod:`.inspection`)."""
