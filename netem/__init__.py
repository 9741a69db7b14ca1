"""The link-shaping sidecar: `netem.linkshaper` (see netem/README.md)."""
