"""This machine, as autotune uses it: processes that die with it (processes), deadlines by the wall
clock (deadline), where its files live (paths) and where a command's output goes (output), and the
environment a probe ran in, whose fingerprint says which measurements are comparable (environment)."""
