"""The box's settings (:func:`load` -> :class:`BoxConfig`), by part: ``values`` (the grammar of
one value), ``listen`` (addresses), ``hibernate`` (the box's buckets), ``mesh``, ``acme``,
and ``box``: the front door's limits, and the reading of them all. Everything importers use is named here."""

# ruff: noqa: F401 -- the imports are this package's public names

from lchat.config.box import DEFAULT_ENV_FILE, DEFAULTS, BoxConfig, ProxyConfig, load, mesh_bucket
from lchat.config.hibernate import MESH_LEASE_TTL, BackupConfig, HibernateConfig
from lchat.config.listen import parse_address
from lchat.config.mesh import MeshConfig
from lchat.config.values import ConfigError, parse_bucket_url, parse_duration, read_env_file
