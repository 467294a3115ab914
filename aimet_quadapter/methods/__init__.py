"""The methods a recipe can name: their catalog, registry, text roles, generated text and plots."""
