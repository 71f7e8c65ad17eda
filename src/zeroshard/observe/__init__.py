"""The observatory: the ledger of bytes allocated per category and bytes sent per collective."""
