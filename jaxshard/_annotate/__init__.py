"""`jaxshard.annotate`: contracts written for you, from a model observed on a mesh."""
