"""Every command's bad input and messages: the catalogue of docs/bad-inputs.md (each
row run, in this process where nothing launches, else as a real launch), and the cases
a table cannot hold."""
