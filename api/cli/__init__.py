"""The `lorafleet` command line: the entry point (the service's commands and the tenant commands
over the REST API), its small HTTP client, the smoke test and the live `adapters watch` table.

May import: api, service.cli.
"""
