"""Tools that read what a job left behind (timelines, flight-recorder dumps): above both
`hvdlite.common` and `hvdlite.runner`, which never import them."""
