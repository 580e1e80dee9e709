"""Predicted time to first token: the online model (`model`) and each pod's queue of
prefill work as this EPP sent it (`ledger`). `predicted-ttft-producer` owns one of
each per pod set; docs/routing.md explains the model."""
