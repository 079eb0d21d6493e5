"""The mesh (docs/design.md §9): several boxes, one bucket, no coordinator (its modules: README.md,
"Code layout")."""
