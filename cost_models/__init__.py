"""Cost models: per-unit memory, compute, communication and optimizer time, from a device profile.

`table.build_cost_table` turns a traced model and its units into per-(unit, option) numbers;
`memory.timeline` and `step.step_time` define per-rank memory at each time point and the step time
over those numbers, written once against an algebra so that the same formulas evaluate a plan
(numbers) and constrain the solver (CP-SAT linear expressions).
"""
