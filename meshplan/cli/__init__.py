"""cli: the `meshplan` command."""
