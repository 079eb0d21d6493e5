"""Space builds on a box: versions, per-host live links, the signed release feed and deploys
(docs/operations.md)."""
