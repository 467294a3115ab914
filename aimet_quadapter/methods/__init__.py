"""The methods a recipe can name: their catalog entries, their functions (the registry), the roles of the texts
they read, the text the FP model samples for them, and the plots of what a method trained."""
