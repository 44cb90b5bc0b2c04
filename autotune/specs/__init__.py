"""Models and cards as data, told without torch: a model reference resolved to its `ModelSpec`
(models) and sizes (shapes), common NVIDIA cards (cards), training FLOPs per token (flops), and how
long a step takes on this CPU (cpu_speed)."""
