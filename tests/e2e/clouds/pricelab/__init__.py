"""The price lab: local servers of RunPod's GraphQL, Vast's bundles and Lambda's instance types
(``servers.py`` says what they do and do not emulate)."""
