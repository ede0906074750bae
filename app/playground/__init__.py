"""The playground: a page at `/` that streams a chat answer and shows where its time went.

Plain HTML, CSS and one script in `static/` (no build step, nothing fetched from elsewhere);
`routes.install_playground` serves them and the JSON `/status` the page polls.
"""
