"""What a probe measured and what it means: `ProbeResult` (probe_result), what "fits" means
(budget: peak reserved + context + margin against the budget), step times and their noise (timing),
the one order configurations rank in (ranking), and the one text of a study's decision (verdict)."""
