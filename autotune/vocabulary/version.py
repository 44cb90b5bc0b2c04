"""autotune's version: one home, read by the package face, the environment fingerprint and the
packaging metadata (pyproject.toml's dynamic version). It is in every probe's environment
fingerprint, so a change in what a probe times raises it: probes stored by an older autotune are then
neither reused nor mixed with new ones. 0.2.0: the probe times Trainer's step (issue 56). 0.3.0:
packed batches carry the attention mask of ones the run's data has; TRL's SFTTrainer step
(`--trainer trl`)."""

__version__ = "0.3.0"
