"""Recipes: complete training programs that drive an openrld node through the real tinker SDK."""
