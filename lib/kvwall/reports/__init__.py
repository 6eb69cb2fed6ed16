"""Layer 5: what chapters call (chapter set-up, execution, plots, tables, per-chapter reports)."""
