"""The `ortspec` command line; other tiers are imported inside the subcommands that need them."""
