"""A unit: the parameters gathered together and reduced together — its layout, its
storages, its lifecycle and what others read off it."""
