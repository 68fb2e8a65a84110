"""Your model and data -> a :class:`Problem`: the partition, the model's sites, the clients' data,
the prior and the start."""

from numpyro_pvi.model.partition import ClientData, partition_plate, split_by_label, split_iid

__all__ = ["ClientData", "partition_plate", "split_iid", "split_by_label"]
