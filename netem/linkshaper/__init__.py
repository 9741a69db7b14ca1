"""Shape a named link profile (asymspec.links) on the edge->cloud and cloud->edge egresses.

Modules: `tc` builds the command lines (pure), `runner` executes them (or records them in
dry-run), `shaper` owns the active profile and the backend choice (netem, or htb where the
kernel has no sch_netem), `metrics` renders it for Prometheus, `control` serves it over HTTP,
`ratecheck` measures what a shaped link really carries.
"""
