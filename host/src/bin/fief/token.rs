//! `fief token new|hash`: make an API token or cluster secret, and hash one
//! for a tokens file's `token_sha256`.

use anyhow::{Context, bail};
use clap::Subcommand;

#[derive(Subcommand)]
pub(crate) enum TokenCommand {
    /// Print a new random token (64 hex digits) and, on stderr, its SHA-256
    /// for a tokens file's `token_sha256`.
    New,
    /// Print the SHA-256 of the token read from standard input.
    Hash,
}

/// `fief token new` / `fief token hash`.
pub(crate) fn token(command: TokenCommand) -> anyhow::Result<()> {
    match command {
        TokenCommand::New => {
            let token = fief::auth::new_token()?;
            println!("{token}");
            eprintln!("sha256: {}", fief::auth::hash_token(&token));
        }
        TokenCommand::Hash => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .context("reading the token from standard input")?;
            let token = line.trim();
            if token.is_empty() {
                bail!("no token on standard input: `echo -n TOKEN | fief token hash`");
            }
            println!("{}", fief::auth::hash_token(token));
        }
    }
    Ok(())
}
