"""Recipes: one module per named setting, each with a ``config() -> MaspoConfig`` function.

``maspo train --recipe NAME`` resolves ``NAME`` to ``megatron_maspo.recipes.NAME:config``; the recipes ship
inside the package so a wheel install has them. ``base`` holds the shared paper setting and is not a recipe.
"""
