"""Background sources that keep the datastore fresh (endpoint sets, metrics, KV
events). Sources write; plugins read."""
