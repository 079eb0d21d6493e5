"""Fleet backup: the router keeps an off-box copy of every database it does not hibernate.

``layout`` (keys in the bucket), ``selection`` (which databases), ``metered`` (what each costs),
``service`` (one replicator per database, handed to and from the activator). docs/backup.md.
"""
