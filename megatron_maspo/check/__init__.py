"""``maspo check``: every shipped recipe's full-size layout, checked shape by shape on the meta device."""
