"""exprd: the per-node daemon that applies spool files (DESIGN 8). Entry point: `exprd.main:entry`."""
