"""What people and scripts read: tables, JSON and CSV of everything below (tables), the live line of
a search on a terminal (live), a study as a figure (plot, `autotune plot`) and as Markdown (report,
`autotune report`), and the tables of `autotune estimate` (estimate_table) and `autotune plan`
(plan_table). No database writes and no torch."""
