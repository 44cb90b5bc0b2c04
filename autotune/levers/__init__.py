"""What one training configuration is: `ProbeConfig` (config), and the levers it is made of: what is
trained (tasks, recipes: optimizer, weights, PEFT), the phases after the step (evaluation), the
examples' lengths and the batches they make (lengths), how ranks share the run (sharding), and the
speed levers that keep the math (speed_levers). docs/levers.md says which are free and which are
the user's recipe."""
