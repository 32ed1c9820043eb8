"""The Python API's calls, each running the stages in order: `trace` (a model read once), `search`,
`estimate` and `frontier`. `import autoplan` exposes them."""
