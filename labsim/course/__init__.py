"""Course tooling: release (solutions -> labs) and grading."""
