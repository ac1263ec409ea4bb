"""The backend contract (hookspec) and the registry that discovers backends through entry points."""
