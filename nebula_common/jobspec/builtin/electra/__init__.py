"""The built-in ELECTRA job (spec + stage modules); `common` is what both stages share."""
