"""Stage 5, the plan: the plan file's schema (`schema`, with the checked-in `plan_schema.json`), its
assembly from the solver's answer (`assemble`), and the readable tables (`report`, `estimate`)."""
