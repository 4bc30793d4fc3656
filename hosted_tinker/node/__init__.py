"""The agent process of a node other than node 0 (``hosted-tinker node``): it starts and ends
that machine's training ranks for the server on node 0. Imports core and rank only."""
