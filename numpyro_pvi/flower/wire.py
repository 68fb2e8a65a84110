"""What travels between a PVI server and its sites under Flower: pytrees as Flower ``ArrayRecord``\\
s.

A pytree's leaves are stored under ``"0"``, ``"1"``, ... in ``jax.tree.leaves`` order; the receiver
knows the structure (both ends hold the family and the dimension), so only arrays travel, never
pickled objects.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

# the PRNG name sent for a raw uint32 key (Flower cannot count the bytes of an empty string)
RAW_KEY = "raw"


def tree_to_record(tree: Any) -> ArrayRecord:
    """A pytree's leaves as an ``ArrayRecord`` (numpy copies, keys ``"0"``, ``"1"``, ...).

    **Example:** ``record = tree_to_record(state.q)``; ``tree_from_record(record,
    family.zeros(dim))``.
    """
    return ArrayRecord(
        {str(i): Array(np.asarray(leaf)) for i, leaf in enumerate(jax.tree.leaves(tree))}
    )


def tree_from_record(record: ArrayRecord, like: Any, what: str = "record") -> Any:
    """The pytree of ``like``'s structure, shapes and dtypes held by ``record`` (from
    :func:`tree_to_record`).

    :raises ValueError: if the record holds other leaves or shapes (a site running another model or
        family).

    **Example:** ``cavity = tree_from_record(message.content["cavity"], family.zeros(dim),
    "cavity")``
    """
    leaves, treedef = jax.tree.flatten(like)
    if sorted(record.keys()) != sorted(str(i) for i in range(len(leaves))):
        raise ValueError(
            f"The {what} holds arrays {sorted(record.keys())}, expected {len(leaves)} leaves: "
            "were the server and the site configured with the same model and family?"
        )
    values = []
    for i, leaf in enumerate(leaves):
        value = record[str(i)].numpy()
        if value.shape != jnp.shape(leaf):
            raise ValueError(
                f"The {what}'s leaf {i} has shape {value.shape}, expected {jnp.shape(leaf)}: were "
                "the server and the site configured with the same model and family?"
            )
        values.append(jnp.asarray(value, jnp.result_type(leaf)))
    return jax.tree.unflatten(treedef, values)


def key_to_record(key: jax.Array) -> tuple[ArrayRecord, str]:
    """A random key as ``(ArrayRecord, impl)``: its raw data, and the name of its PRNG if it is a
    typed key (``"raw"`` for a raw ``uint32`` key such as ``random.PRNGKey(0)``)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return ArrayRecord({"0": Array(np.asarray(jax.random.key_data(key)))}), str(
            jax.random.key_impl(key)
        )
    return ArrayRecord({"0": Array(np.asarray(key))}), RAW_KEY


def key_from_record(record: ArrayRecord, impl: str) -> jax.Array:
    """The random key :func:`key_to_record` stored (a typed key again if ``impl`` names its
    PRNG)."""
    data = jnp.asarray(record["0"].numpy())
    return data if impl == RAW_KEY else jax.random.wrap_key_data(data, impl=impl)


def content_bytes(content: RecordDict) -> int:
    """The payload of a message's content in bytes (its arrays, configs and metrics as Flower counts
    them).

    **Example:** ``content_bytes(message.content)``
    """
    return int(sum(record.count_bytes() for record in content.values()))


def layout_to_text(family: Any, sites: Any) -> str:
    """What the server needs to lay out its copy of ``family`` as the site's, as JSON: the global
    sites' shapes and the family's own :meth:`~numpyro_pvi.families.FactorFamily.layout` (e.g. a
    :class:`~numpyro_pvi.SiteFamilies`' blocks; ``None`` for a Gaussian).

    **Example:** ``layout_to_text(family, problem.sites)``; the server calls :func:`adopt_layout`
    with it.
    """
    return json.dumps(
        {"shapes": {s.name: list(s.shape) for s in sites.globals}, "layout": family.layout()}
    )


def adopt_layout(family: Any, text: str) -> Any:
    """``family`` laid out as :func:`layout_to_text` described a site's
    (:meth:`~numpyro_pvi.families.FactorFamily.with_layout`): a new family (``family`` itself for a
    Gaussian), never ``family`` changed; the caller keeps the returned one.

    :raises ValueError: if the family cannot be laid out so (the site runs another family).

    **Example:** ``strategy.family = adopt_layout(strategy.family, config["layout"])``.
    """
    layout = json.loads(text)
    shapes = {name: tuple(shape) for name, shape in layout["shapes"].items()}
    return family.with_layout(layout["layout"], shapes)
